"""Training pipeline: gen-data, feature capture, anchors, loss, trainer."""
