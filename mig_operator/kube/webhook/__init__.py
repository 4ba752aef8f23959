"""The admission webhook: a pod that asks for GPUs gets a gate and the ResourceClaims of its slices."""
