"""prove-local: proposer-verifier (ProVe) decoding on llama.cpp."""
__version__ = "0.1.0"
