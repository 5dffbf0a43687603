"""The models muse-stack trains, one folder each: configuration, perception towers, the Hugging
Face mapping and a reference implementation in plain PyTorch."""
