"""`mooncake soak`: a local cluster under load and faults for a set time (`run.py`), the
faults and the timing of the cluster's return (`faults.py`), the network namespaces and
links it degrades (`netns.py`), and each process's memory over time (`rss.py`)."""
