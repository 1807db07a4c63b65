"""Proofs on real TensorFlow processes: a stand-in GPU with a hard memory limit (:mod:`lmscli.prove.standin`)."""
