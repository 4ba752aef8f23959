"""What `mig-operator top` shows, as text and as JSON."""
