from mooncake.bench.gpubench.run import main

raise SystemExit(main())
