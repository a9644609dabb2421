"""The runtime: the machinery the template imports and a project keeps as it is.

Each module names its public API in its docstring. Nothing here imports the template's modules
(`fmnist_flax/*.py`) or the codelab's: the model, task, data and optimizer arrive as arguments
or through the registries the template fills.
"""
