"""Master high availability on etcd (see docs/ha.md).

- `etcd.py`: a small etcd v3 client over its JSON gateway (httpx).
- `election.py`: masters campaign for leadership with a lease; who leads, who stands by.
- `journal.py`: `EtcdJournal`, the pool's committed state in etcd, fenced on leadership.
- `forward.py`: a standby's HTTP API: every request forwarded to the leader.
"""
