"""hybridtitan: a native-PyTorch trainer for hybrid language models (linear-recurrent mixers + MLA + SwiGLU).

Importing the package imports nothing heavy; ``import hybridtitan.hf`` registers hybridtitan's model type with
transformers' Auto classes (an export also loads without it: ``trust_remote_code=True`` runs the folder's code).
"""

import logging

__version__ = "0.1.0"

# Where torchao is installed (float8 training), transformers imports it with every model class, and torchao 0.18
# logs warnings at import that are no user's to act on: its CUDA extensions failing to load on a machine without
# them, and a torch.compile deprecation of its own code. They would come before every command's output and
# its one-line errors; errors of those two loggers still show.
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
