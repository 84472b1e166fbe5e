"""fedfuse on Flower: the app, the wire codec and the deployment helpers (:mod:`fedfuse.flower.deploy`)."""
