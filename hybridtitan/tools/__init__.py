"""Developer tools that are not part of training: kernel recording for the ROCm compile check."""
