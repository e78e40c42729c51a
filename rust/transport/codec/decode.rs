//! The consumer's side of the codec: a frame's spec resolved once for decoding
//! ([`DecodeSpec`]: dtypes, dict keys, namedtuple classes) and the copy of one leaf out of a
//! payload ([`copy_leaf`]).

use super::*;

/// A spec as the consumer uses it: numpy dtypes, dict keys (as Python str objects) and
/// namedtuple classes resolved once, so building an element makes no key or class lookup.
pub struct DecodeSpec {
    pub spec: Spec,
    pub leaves: Vec<LeafSpec>,
    pub dtypes: Vec<Option<Py<PyAny>>>,
    node: Node,
}

/// `Spec` with its Python objects made: what `DecodeSpec::build` walks.
enum Node {
    Leaf,
    Tuple(Vec<Node>),
    List(Vec<Node>),
    /// Its items, and a dict of its keys (values None) that each element's dict is copied
    /// from: built at its final size, not grown key by key.
    Dict(Vec<(Py<PyString>, Node)>, Py<PyDict>),
    NamedTuple(Py<PyAny>, Vec<Node>),
}

impl Node {
    fn new(
        py: Python<'_>,
        spec: &Spec,
        classes: &HashMap<(String, String), Py<PyAny>>,
    ) -> PyResult<Node> {
        let items = |items: &[Spec]| -> PyResult<Vec<Node>> {
            items.iter().map(|i| Node::new(py, i, classes)).collect()
        };
        Ok(match spec {
            Spec::Leaf(_) => Node::Leaf,
            Spec::Tuple(i) => Node::Tuple(items(i)?),
            Spec::List(i) => Node::List(items(i)?),
            Spec::Dict(kv) => {
                let template = PyDict::new(py);
                let mut items = Vec::with_capacity(kv.len());
                for (k, v) in kv {
                    let key = PyString::intern(py, k);
                    template.set_item(&key, py.None())?;
                    items.push((key.unbind(), Node::new(py, v, classes)?));
                }
                Node::Dict(items, template.unbind())
            }
            Spec::NamedTuple {
                module,
                name,
                items: i,
                ..
            } => {
                let cls = classes
                    .get(&(module.clone(), name.clone()))
                    .ok_or_else(|| PyValueError::new_err("namedtuple class not resolved"))?;
                Node::NamedTuple(cls.clone_ref(py), items(i)?)
            }
        })
    }
}

/// Whether a spec's dtype can be a user-defined dtype's name (codec.rs): `dtype.str` always
/// starts with a byte order character; a name is an identifier (a damaged frame's is not,
/// mostly: an unknown name is refused as damage too, naming what to install).
fn is_dtype_name(dtype: &str) -> bool {
    dtype.starts_with(|c: char| c.is_ascii_alphabetic())
        && dtype.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A user-defined dtype named `name` that numpy does not know yet in this process: ml_dtypes
/// (bfloat16, float8_*, int4, ...) is imported, as the producer's pipeline did. Err: why
/// not (ml_dtypes missing, or it does not define `name`).
fn user_dtype<'py>(py: Python<'py>, name: &str) -> Result<Bound<'py, PyAny>, String> {
    if py.import("ml_dtypes").is_err() {
        return Err(
            "a user-defined numpy dtype unknown in this process, and ml_dtypes \
                    (bfloat16, float8_*, int4) is not installed: pip install ml_dtypes, or \
                    import the module that defines it"
                .to_string(),
        );
    }
    let dtype = api(py).map_err(|e| e.to_string())?.dtype.bind(py).clone();
    dtype.call1((name,)).map_err(|_| {
        "a user-defined numpy dtype unknown in this process (not ml_dtypes'): import the \
         module that defines it before reading"
            .to_string()
    })
}

impl DecodeSpec {
    pub fn new(py: Python<'_>, spec: Spec, pos: u64) -> Result<Self, PyErr> {
        let api = api(py)?;
        let leaves: Vec<LeafSpec> = spec.leaves().into_iter().cloned().collect();
        let mut dtypes = Vec::with_capacity(leaves.len());
        for leaf in &leaves {
            if matches!(leaf.kind, LeafKind::Array | LeafKind::Scalar) {
                let bad = |what: &str| -> PyErr {
                    Error::RingCorrupted {
                        pos,
                        what: format!("spec dtype {:?}: {what}", leaf.dtype),
                    }
                    .into()
                };
                let dt = match api.dtype.bind(py).call1((leaf.dtype.as_str(),)) {
                    Ok(dt) => dt,
                    Err(_) if is_dtype_name(&leaf.dtype) => {
                        user_dtype(py, &leaf.dtype).map_err(|why| bad(&why))?
                    }
                    Err(_) => return Err(bad("not a numpy dtype")),
                };
                let hasobject: bool = dt.getattr("hasobject")?.extract()?;
                let itemsize: u32 = dt.getattr("itemsize")?.extract()?;
                // Raw bytes must never become object pointers.
                if hasobject || itemsize != leaf.itemsize || itemsize == 0 {
                    return Err(bad("holds objects or its itemsize differs"));
                }
                dtypes.push(Some(dt.unbind()));
            } else {
                dtypes.push(None);
            }
        }
        let mut classes = HashMap::new();
        resolve_classes(py, &spec, &mut classes)?;
        let node = Node::new(py, &spec, &classes)?;
        Ok(DecodeSpec {
            spec,
            leaves,
            dtypes,
            node,
        })
    }

    /// Builds one element from its leaves (in flatten order).
    pub fn build(
        &self,
        py: Python<'_>,
        leaves: &mut impl Iterator<Item = Py<PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        build_node(py, &self.node, leaves)
    }
}

fn build_node(
    py: Python<'_>,
    node: &Node,
    leaves: &mut impl Iterator<Item = Py<PyAny>>,
) -> PyResult<Py<PyAny>> {
    let missing = || PyValueError::new_err("element has fewer leaves than its spec");
    let items = |items: &[Node], leaves: &mut _| -> PyResult<Vec<Py<PyAny>>> {
        items.iter().map(|i| build_node(py, i, leaves)).collect()
    };
    Ok(match node {
        Node::Leaf => leaves.next().ok_or_else(missing)?,
        Node::Tuple(i) => PyTuple::new(py, items(i, leaves)?)?.into_any().unbind(),
        Node::List(i) => PyList::new(py, items(i, leaves)?)?.into_any().unbind(),
        Node::Dict(kv, template) => {
            let d = template.bind(py).copy()?;
            for (k, v) in kv {
                d.set_item(k.bind(py), build_node(py, v, leaves)?)?;
            }
            d.into_any().unbind()
        }
        Node::NamedTuple(cls, i) => cls
            .bind(py)
            .call1(PyTuple::new(py, items(i, leaves)?)?)?
            .unbind(),
    })
}

/// Imports each namedtuple class by module and qualname, or recreates it by name.
fn resolve_classes(
    py: Python<'_>,
    spec: &Spec,
    out: &mut HashMap<(String, String), Py<PyAny>>,
) -> PyResult<()> {
    match spec {
        Spec::Leaf(_) => {}
        Spec::Tuple(items) | Spec::List(items) => {
            for i in items {
                resolve_classes(py, i, out)?;
            }
        }
        Spec::Dict(items) => {
            for (_, v) in items {
                resolve_classes(py, v, out)?;
            }
        }
        Spec::NamedTuple {
            module,
            name,
            fields,
            items,
        } => {
            for i in items {
                resolve_classes(py, i, out)?;
            }
            let key = (module.clone(), name.clone());
            if out.contains_key(&key) {
                return Ok(());
            }
            let imported = (|| -> PyResult<Bound<'_, PyAny>> {
                let mut obj = py.import(module.as_str())?.into_any();
                for part in name.split('.') {
                    obj = obj.getattr(part)?;
                }
                let f: Vec<String> = obj.getattr("_fields")?.extract()?;
                if &f != fields {
                    return Err(PyValueError::new_err("fields differ"));
                }
                Ok(obj)
            })();
            let cls = match imported {
                Ok(c) => c,
                Err(_) => {
                    let short = name.rsplit('.').next().unwrap_or(name);
                    let short = if short.is_empty()
                        || !short.chars().all(|c| c.is_alphanumeric() || c == '_')
                    {
                        "Element"
                    } else {
                        short
                    };
                    api(py)?
                        .namedtuple
                        .bind(py)
                        .call1((short, fields.clone()))
                        .or_else(|_| {
                            let names: Vec<String> =
                                (0..fields.len()).map(|i| format!("f{i}")).collect();
                            api(py)?.namedtuple.bind(py).call1((short, names))
                        })?
                }
            };
            out.insert(key, cls.unbind());
        }
    }
    Ok(())
}

/// Decodes a copied (not leased) leaf.
pub fn copy_leaf(
    py: Python<'_>,
    spec: &DecodeSpec,
    index: usize,
    desc: &LeafDesc,
    payload: &[u8],
    pos: u64,
) -> PyResult<Py<PyAny>> {
    let api = api(py)?;
    Ok(match desc.kind {
        LeafKind::Array => {
            let dtype = spec.dtypes[index].as_ref().expect("array leaf has a dtype");
            let shape = PyTuple::new(py, desc.dims.iter())?;
            let arr = api.empty.bind(py).call1((shape, dtype.bind(py)))?;
            if !payload.is_empty() {
                let held = HeldBuffer::get(&arr, ffi::PyBUF_WRITABLE | ffi::PyBUF_C_CONTIGUOUS)
                    .ok_or_else(|| PyValueError::new_err("numpy.empty gave no writable buffer"))?;
                if held.bytes().len() != payload.len() {
                    return Err(Error::RingCorrupted {
                        pos,
                        what: "array size mismatch".into(),
                    }
                    .into());
                }
                let dst = SendPtr(held.bytes().as_ptr() as *mut u8);
                let src = SendPtr(payload.as_ptr() as *mut u8);
                let n = payload.len();
                let copy = move || {
                    let (dst, src) = (dst, src);
                    // SAFETY: dst is the new array's n writable bytes (pinned by `held`);
                    // src is n validated bytes of a frame we own until it is released.
                    unsafe { std::ptr::copy_nonoverlapping(src.0, dst.0, n) }
                };
                super::copy_detached_if_large(py, n, copy);
            }
            arr.unbind()
        }
        LeafKind::Bytes => PyBytes::new(py, payload).into_any().unbind(),
        LeafKind::Str => {
            let s = std::str::from_utf8(payload).map_err(|_| Error::RingCorrupted {
                pos,
                what: "str leaf is not UTF-8".into(),
            })?;
            PyString::new(py, s).into_any().unbind()
        }
        LeafKind::PyInt => i64::from_le_bytes(payload.try_into().unwrap())
            .into_pyobject(py)?
            .into_any()
            .unbind(),
        LeafKind::PyFloat => f64::from_le_bytes(payload.try_into().unwrap())
            .into_pyobject(py)?
            .into_any()
            .unbind(),
        LeafKind::PyBool => PyBool::new(py, payload[0] != 0)
            .to_owned()
            .into_any()
            .unbind(),
        LeafKind::None => py.None(),
        LeafKind::Pickle => api
            .loads
            .bind(py)
            .call1((PyBytes::new(py, payload),))?
            .unbind(),
        LeafKind::VarBytes => {
            let n = desc.dims.iter().product::<u64>() as usize;
            let items = frame::varbytes_items(payload, n, pos)?;
            let list = PyList::new(py, items.iter().map(|b| PyBytes::new(py, b)))?;
            let arr = if n == 0 {
                api.empty.bind(py).call1((0, api.object_dtype.bind(py)))?
            } else {
                let arr = api.empty.bind(py).call1((n, api.object_dtype.bind(py)))?;
                for (i, item) in list.iter().enumerate() {
                    arr.set_item(i, item)?;
                }
                arr
            };
            arr.call_method1("reshape", (PyTuple::new(py, desc.dims.iter())?,))?
                .unbind()
        }
        LeafKind::Scalar => unreachable!("scalars are decoded column-wise"),
    })
}
