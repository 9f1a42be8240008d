"""An example autopar plugin: one graph pass, one sharding rule, one constraint.

    pip install ./examples/plugin
    autopar plugins                       # lists erf-gelu, scaled-tanh, dp-power-of-two
    autopar emit gpt:layers=2,hidden=64,heads=2,vocab=128,seq=32 --cluster 2xcpu --tp 2
    # every rank's program now calls erf_gelu where it called aten.gelu
"""
