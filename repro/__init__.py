"""megatron-repro: a reproduction of Megatron-LM (Shoeybi et al., 2019).

Throughout this package the paper's "model parallel" means *tensor* parallel (tp): intra-layer
splitting of weight matrices across the ranks of a tensor-parallel group. Data parallel is dp.
Importing the package has no side effects.
"""

__version__ = "0.1.0"
