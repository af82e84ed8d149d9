"""Models: the built-in ones, torchvision's and timm's, users' own, and whether a model takes the data."""
