"""Master high availability on etcd (see docs/ha.md).

- `etcd.py`: a small etcd v3 client over its JSON gateway (HTTP/1.1 kept alive), auth and TLS.
- `etcdaccess.py`: `create_etcd`: that client with the credentials `[cluster]` names.
- `sealed.py`: values sealed with the cluster secret, so a forged one is never trusted.
- `election.py`: masters campaign for leadership with a lease; who leads, who stands by.
- `journal.py`: `EtcdJournal`, the pool's committed state in etcd, fenced on leadership.
- `forward.py`: a standby's HTTP API: every request forwarded to the leader.
"""
