"""What every node process shares.

- `common`     identity, secret, ready handshake, signals, `MasterLink`
- `worker`     model and cache loading and sizing, the node's own pool tiers and Store client
- `messages`   the cluster's control-plane messages (`node.*`, `prefill.*`, `decode.*`)
- `delivery`   the token stream's delivery, decode node to master
- `watchdog`, `sdnotify`   the serving thread watched; systemd told ready and stopping
"""
