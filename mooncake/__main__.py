from mooncake.cli.app import main

main()
