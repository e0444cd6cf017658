"""hybridtitan: a native-PyTorch trainer for hybrid language models (linear-recurrent mixers + MLA + SwiGLU)."""

__version__ = "0.1.0"
