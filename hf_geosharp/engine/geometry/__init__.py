"""The geometries a perturbation space is made of: the GL(h) quotient of attention head pairs, the elementwise
rescaling metric of adaptive sharpness, and the Lie algebras of the groups acting on a pair."""
