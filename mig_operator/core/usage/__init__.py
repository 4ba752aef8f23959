"""What a slice really uses: the figures its node's agent measures (``figures``), when a slice counts as idle
and which pods an idle policy evicts (``idle``), and the smaller size that would have held its peak (``advice``)."""
