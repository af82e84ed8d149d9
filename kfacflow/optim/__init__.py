"""The first-order optimizers that apply the (preconditioned) gradient: SGD, AdamW, Muon, users' own."""
