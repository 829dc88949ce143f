"""Rollout: the Sample (token ids in, token ids out) and the engines that produce them."""
