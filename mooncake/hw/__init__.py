"""What a node is: its hardware facts and its readiness (the OS and driver calls are in
`mooncake.native`).

- `topology`     `Topology`: GPUs, NICs, NUMA nodes, disks; the NIC priority per GPU
- `doctor`       `mooncake doctor`'s checks over recorded facts
- `doctorconfig` `mooncake doctor --config`: the SSD directory, ports, the master reached
- `ssdplace`     where a node's SSD tier goes and how big it is
"""
