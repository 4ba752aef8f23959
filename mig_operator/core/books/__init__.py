"""The controller's books: the ledger and what it keeps (charges, quotas, the waiting line), a slice's claim, and
the checks made before a device is handed on."""
