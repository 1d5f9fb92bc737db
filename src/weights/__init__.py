"""Weights: names, files, loading, conversion and pretrained weights, in layers that import one way only.

names       pure name handling: torch <-> MindSpore names, the models-zoo/mindcv/torch naming schemes, and
            which architecture and class count a set of names shows (no file I/O, no MindSpore)
files       reading and writing weight files: .ckpt (record by record, CRC-checked), PyTorch .pth, atomic
            writes, SHA-256 pins; imports names only
loading     the one checked loading path into a network (load_weights_report); imports names and files
convert     convert_pth.py's checked .pth <-> .ckpt conversion and --verify; imports names and files
pretrained  train.py --pretrained: registry, download, then loading

Nothing here imports the package's modules: importing src.weights.names loads no other layer.
"""
