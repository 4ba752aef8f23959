"""GPU backends behind one protocol: real NVML and a faithful simulator."""
