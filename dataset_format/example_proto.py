"""`tf.train.Example` encode/decode without TensorFlow.

The message classes are built at first use from a descriptor written here, in a private
descriptor pool (so they never clash with TensorFlow's own classes if both are loaded).
The wire format is the same as TensorFlow's: records written here parse with
`tf.train.Example.FromString` and the other way round.

    data = encode_example({"label": [3], "image": b"..."})
    decode_example(data)  # {"label": array([3]), "image": array([b"..."], dtype=object)}
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory


@functools.cache
def example_class():
    f = descriptor_pb2.FileDescriptorProto(name="arrayrecord_platform/example.proto", package="arp", syntax="proto3")
    label = descriptor_pb2.FieldDescriptorProto

    def message(name, *fields, options=None):
        m = f.message_type.add(name=name)
        for field in fields:
            m.field.add(**field)
        if options:
            m.options.CopyFrom(options)
        return m

    repeated = label.LABEL_REPEATED
    message("BytesList", dict(name="value", number=1, label=repeated, type=label.TYPE_BYTES))
    message("FloatList", dict(name="value", number=1, label=repeated, type=label.TYPE_FLOAT))
    message("Int64List", dict(name="value", number=1, label=repeated, type=label.TYPE_INT64))
    feature = message(
        "Feature",
        dict(name="bytes_list", number=1, type=label.TYPE_MESSAGE, type_name=".arp.BytesList", oneof_index=0),
        dict(name="float_list", number=2, type=label.TYPE_MESSAGE, type_name=".arp.FloatList", oneof_index=0),
        dict(name="int64_list", number=3, type=label.TYPE_MESSAGE, type_name=".arp.Int64List", oneof_index=0),
    )
    feature.oneof_decl.add(name="kind")
    features = message("Features", dict(name="feature", number=1, label=repeated, type=label.TYPE_MESSAGE,
                                        type_name=".arp.Features.FeatureEntry"))
    entry = features.nested_type.add(name="FeatureEntry")
    entry.field.add(name="key", number=1, type=label.TYPE_STRING)
    entry.field.add(name="value", number=2, type=label.TYPE_MESSAGE, type_name=".arp.Feature")
    entry.options.map_entry = True
    message("Example", dict(name="features", number=1, type=label.TYPE_MESSAGE, type_name=".arp.Features"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("arp.Example"))


def encode_example(features: Mapping[str, object]) -> bytes:
    """Serialises a dict of bytes / str / ints / floats (scalars, lists or arrays) as an Example."""
    example = example_class()()
    for key, value in features.items():
        feature = example.features.feature[key]
        values = value if isinstance(value, (list, tuple, np.ndarray)) else [value]
        array = np.asarray(values)
        if array.dtype.kind in "SUO":
            feature.bytes_list.value.extend(v.encode() if isinstance(v, str) else bytes(v) for v in values)
        elif array.dtype.kind in "iub":
            feature.int64_list.value.extend(array.astype(np.int64).ravel().tolist())
        elif array.dtype.kind == "f":
            feature.float_list.value.extend(array.astype(np.float32).ravel().tolist())
        else:
            raise TypeError(f"feature {key!r}: cannot encode values of dtype {array.dtype}; use bytes, ints "
                            "or floats")
    return example.SerializeToString()


def decode_example(data: bytes) -> dict[str, np.ndarray]:
    """Parses an Example into {key: 1-D array} (int64, float32, or object array of bytes), keys sorted."""
    example = example_class().FromString(data)
    out = {}
    for key, feature in sorted(example.features.feature.items()):
        kind = feature.WhichOneof("kind")
        if kind == "int64_list":
            out[key] = np.array(feature.int64_list.value, dtype=np.int64)
        elif kind == "float_list":
            out[key] = np.array(feature.float_list.value, dtype=np.float32)
        elif kind == "bytes_list":
            out[key] = np.array(list(feature.bytes_list.value), dtype=object)
        else:
            out[key] = np.zeros((0,), dtype=np.float32)
    return out
