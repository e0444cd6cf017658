"""hybridtitan: a native-PyTorch trainer for hybrid language models (linear-recurrent mixers + MLA + SwiGLU)."""

__version__ = "0.1.0"

# Registers the hybridtitan model type with transformers' AutoConfig / AutoModelForCausalLM.
from hybridtitan import hf  # noqa: E402,F401
