"""The perturbation space: the solver's view of the model (tangent vectors as one flat tensor, norms, projection,
the geodesic point), where the pairs sit in the flat vector, and the slow dense reference the tests compare with."""
