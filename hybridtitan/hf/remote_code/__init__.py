"""The code an export of hybridtitan's own layout carries (``model_type: hybridtitan``): the two files that its
``auto_map`` names, copied into every such folder by the export and by ``save_pretrained``.

They are plain, self-contained modules (torch and transformers; FLA's kernels when it imports and the tensors are
on a GPU) and never import hybridtitan, so the folder loads with ``trust_remote_code=True`` anywhere. Nothing
here is imported by hybridtitan itself, which keeps its own classes in ``hybridtitan.hf``.
"""
