"""The controller: binds GpuSlices, owns pods' slices, serves the admission webhook. Never imports gpu/."""
