"""GPU nodes that come and go with a node autoscaler: the node pools an admin describes, how many new
nodes of each would let the waiting slices be placed, and which nodes are leaving or must stay."""
