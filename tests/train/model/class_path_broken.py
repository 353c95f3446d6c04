"""A model module that fails while importing: model.class_path names the failure in one line."""

raise RuntimeError("this module needs a GPU driver it cannot find")
