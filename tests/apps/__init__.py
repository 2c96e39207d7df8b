"""Small applications the integration tests run over TCP and over RDMA."""
