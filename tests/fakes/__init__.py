"""Fakes for hardware that cannot exist on the test machines (GPU, NVML, RDMA NIC), and
recorded sysfs trees expanded from tests/fixtures/topology."""
