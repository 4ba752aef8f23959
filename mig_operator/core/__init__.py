"""Pure decisions, no I/O, in rooms by domain: requests (what is asked), placement (where it goes),
books (what the controller keeps), node (a slice's life on its node), views (what top shows)."""
