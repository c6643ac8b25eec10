"""The evaluate face: what ``evaluate.load("geodesic_sharpness")`` returns and how evaluate finds it.

* :mod:`.measurement`: :class:`~.measurement.GeodesicSharpness`, the ``evaluate.Measurement`` (imports evaluate,
  datasets and the engine, so it is imported only by the loading script, never by ``import hf_geosharp``);
* :mod:`.register`: where the published module lies and ``geosharp register``, which copies its loading script into
  evaluate's module cache so that the bare name resolves from any directory.

The published module itself (the loading script and the measurement card, as on the Hub) is the repository's top-level
``metric_card/`` folder; a wheel ships it as ``hf_geosharp/metric_card/``.
"""
