"""The Store's master side as a server: `service` (`StoreService`: metadata + RPC +
direct channel + expiry loop + journal), `messages` (the `store.*` wire structs), `direct`
(store calls over the data-plane connection) and `metrics` (Prometheus)."""
