"""What the model's hooks capture: factors as layers run, their hand-over, rows, the forward passes."""
