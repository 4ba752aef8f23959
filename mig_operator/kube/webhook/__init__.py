"""The admission webhook: annotated pods get a gate, their slice's ConfigMap and the shim volume."""
