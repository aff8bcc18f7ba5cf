"""``python -m ddp.bench``: our DDP against torch's on the same model, in one job."""
