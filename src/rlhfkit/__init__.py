"""rlhfkit: composable PPO/RLHF building blocks for large language models.

A library, not a framework: every block is a module with a typed API that is useful alone, and your script is the
loop that joins them. Importing ``rlhfkit`` imports nothing heavy; import the block you need::

    import rlhfkit.packing, rlhfkit.advantages, rlhfkit.losses   # torch only
    from rlhfkit.engines.hf import HFEngine                       # needs rlhfkit[hf]
"""

__version__ = "0.1.0.dev0"
__all__ = ["__version__"]
