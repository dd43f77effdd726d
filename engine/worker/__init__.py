"""What runs a scheduled batch on the device: the model runner (input buffers, padding, graph dispatch) and the
sampler."""
