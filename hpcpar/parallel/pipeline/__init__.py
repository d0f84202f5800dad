"""Pipeline parallelism: which layers each stage holds."""
