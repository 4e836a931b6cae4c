"""What a layer represents: sparse autoencoders (SAEs) over one layer's tokens, trained on the model
and images a person has, browsed through an index of each latent's top patches, and steered
inside the forward pass for one call. The SAE, the tokens it reads, its training, its index and
steering are kept apart, as saev keeps its nn, data and browser.

    sae.py        the TopK sparse autoencoder, its config, its file (tensors + card) and checks
    tokens.py     the images an SAE trains on (ImageSource) and one layer's tokens, in batches
    train.py      an SAE run: the loop as a generator of events, data-parallel under torchrun
    index.py      each latent's top-activating patches, how often it fires, its histogram
    steering.py   one latent scaled inside the forward pass at its layer, for one call
    effects.py    which latents matter for one image's prediction: activation x gradient, the top
                  few really removed
"""
