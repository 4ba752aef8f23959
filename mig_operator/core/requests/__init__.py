"""What a workload asks for: quantities, the request forms, the GpuSlice spec's rules, admission."""
