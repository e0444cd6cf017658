"""hybridtitan: a native-PyTorch trainer for hybrid language models (linear-recurrent mixers + MLA + SwiGLU).

Importing the package imports nothing heavy; ``import hybridtitan.hf`` registers hybridtitan's model type with
transformers' Auto classes (an export also loads without it: ``trust_remote_code=True`` runs the folder's code).
"""

__version__ = "0.1.0"
