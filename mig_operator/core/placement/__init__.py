"""Where a slice goes: the profile catalog, the cluster's records, the MIG and fraction planners and their
refusals, compute shares, tenancy, trace replay."""
