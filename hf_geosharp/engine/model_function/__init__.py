"""The model as a function of the perturbation, and the guarantee that the user's model is left exactly as it was."""
