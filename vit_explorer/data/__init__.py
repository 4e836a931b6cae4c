"""What goes into a model: one image (images.py: any upload -> RGB -> a normalised input) and
datasets (datasets.py: the built-in shapes, torchvision's datasets, a folder of class folders, and
the loader that batches and augments them on the device), and a labelled folder for segmentation
(labelled_folder.py: pictures, masks of class indices and the papers' class files, checked)."""
