//! [`PlainStructure`]: an element's structure learnt once, to check the next elements of a
//! stream against without a Python call per leaf.

use super::*;

/// Most values a [`PlainStructure`] holds (codec.py's `MAX_WALK_NODES`: past it Python's
/// `element_nbytes` estimates).
const PLAIN_MAX_NODES: usize = 10_000;
/// Deepest container a [`PlainStructure`] holds (codec.py's `_MAX_DEPTH`: deeper nests are
/// pickled).
const PLAIN_MAX_DEPTH: usize = 32;

/// The structure of an element of plain numpy values, learnt from one element, to check
/// the next ones of a stream against without a Python call per leaf: an element matches
/// when its containers are of the same exact types, lengths and dict keys, and each leaf of
/// the same exact type (arrays: the same dtype object and rank; numpy scalars: the same
/// type). A match has the learnt element's `codec.signature` (the converse need not hold:
/// an equal dtype that is another object does not match, and Python decides).
pub struct PlainStructure {
    node: CNode,
}

impl PlainStructure {
    /// The structure of `obj`, or None if it holds anything but plain numpy values: numpy
    /// arrays (exact type, no objects) and numeric numpy scalars, bytes, str, int, float,
    /// bool and None (exact types), in exact tuples, lists and dicts with str keys and in
    /// namedtuples; at most 32 levels deep and 10,000 values.
    pub fn learn(obj: &Bound<'_, PyAny>) -> PyResult<Option<PlainStructure>> {
        let mut nodes = 0;
        Ok(plain_node(obj, &mut nodes, 0)?.map(|node| PlainStructure { node }))
    }

    /// The bytes of `obj` as `codec.element_nbytes` counts them if it has this structure,
    /// else None.
    pub fn nbytes_if_same(&self, obj: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
        plain_nbytes(obj, &self.node)
    }
}

fn plain_node(obj: &Bound<'_, PyAny>, nodes: &mut usize, depth: usize) -> PyResult<Option<CNode>> {
    let py = obj.py();
    *nodes += 1;
    if *nodes > PLAIN_MAX_NODES {
        return Ok(None);
    }
    if npy::is_exact_ndarray(obj)? {
        let Some(info) = npy::array_info(obj)? else {
            return Ok(None);
        };
        let ndim = info.dims.len();
        let dtype = obj.getattr(intern!(py, "dtype"))?;
        if dtype.getattr(intern!(py, "hasobject"))?.extract::<bool>()? {
            return Ok(None);
        }
        let itemsize: u32 = dtype.getattr(intern!(py, "itemsize"))?.extract()?;
        return Ok(Some(CNode::Array {
            dtype: dtype.unbind(),
            ndim,
            itemsize,
        }));
    }
    if obj.is_instance(api(py)?.generic.bind(py))? {
        let dtype = obj.getattr(intern!(py, "dtype"))?;
        let kind: char = dtype.getattr(intern!(py, "kind"))?.extract()?;
        // numpy str and bytes scalars are also str and bytes (counted by length).
        if !matches!(kind, 'b' | 'i' | 'u' | 'f' | 'c' | 'M' | 'm') {
            return Ok(None);
        }
        let itemsize: u32 = dtype.getattr(intern!(py, "itemsize"))?.extract()?;
        return Ok(Some(CNode::Scalar {
            ty: obj.get_type().unbind(),
            itemsize,
        }));
    }
    if obj.is_exact_instance_of::<PyBytes>() {
        return Ok(Some(CNode::Bytes));
    }
    if obj.is_exact_instance_of::<PyString>() {
        return Ok(Some(CNode::Str));
    }
    if obj.is_exact_instance_of::<PyBool>() {
        return Ok(Some(CNode::PyBool));
    }
    if obj.is_exact_instance_of::<PyInt>() {
        return Ok(Some(CNode::PyInt));
    }
    if obj.is_exact_instance_of::<PyFloat>() {
        return Ok(Some(CNode::PyFloat));
    }
    if obj.is_none() {
        return Ok(Some(CNode::None));
    }
    if depth >= PLAIN_MAX_DEPTH {
        return Ok(None);
    }
    let items = |it: &mut dyn Iterator<Item = Bound<'_, PyAny>>,
                 n: usize,
                 nodes: &mut usize|
     -> PyResult<Option<Vec<CNode>>> {
        if *nodes + n > PLAIN_MAX_NODES {
            return Ok(None); // give up before walking, not after
        }
        let mut out = Vec::with_capacity(n);
        for item in it {
            match plain_node(&item, nodes, depth + 1)? {
                Some(node) => out.push(node),
                None => return Ok(None),
            }
        }
        Ok(Some(out))
    };
    if let Ok(t) = obj.cast::<PyTuple>() {
        let named = !obj.is_exact_instance_of::<PyTuple>();
        if named && !obj.get_type().hasattr(intern!(py, "_fields"))? {
            return Ok(None);
        }
        return Ok(items(&mut t.iter(), t.len(), nodes)?.map(|v| {
            if named {
                CNode::NamedTuple(obj.get_type().unbind(), v)
            } else {
                CNode::Tuple(v)
            }
        }));
    }
    if let Ok(l) = obj.cast_exact::<PyList>() {
        return Ok(items(&mut l.iter(), l.len(), nodes)?.map(CNode::List));
    }
    if let Ok(d) = obj.cast_exact::<PyDict>() {
        if *nodes + d.len() > PLAIN_MAX_NODES {
            return Ok(None);
        }
        let mut keys = Vec::with_capacity(d.len());
        let mut out = Vec::with_capacity(d.len());
        for (k, v) in d.iter() {
            let Ok(k) = k.cast_exact::<PyString>() else {
                return Ok(None);
            };
            match plain_node(&v, nodes, depth + 1)? {
                Some(node) => {
                    keys.push(k.clone().unbind());
                    out.push(node);
                }
                None => return Ok(None),
            }
        }
        // The keys in the dict's own order.
        let keys = DictKeys {
            keys,
            in_order: true,
        };
        return Ok(Some(CNode::Dict(keys, out)));
    }
    Ok(None)
}

fn plain_nbytes(obj: &Bound<'_, PyAny>, node: &CNode) -> PyResult<Option<u64>> {
    let py = obj.py();
    let same_items = |values: &mut dyn Iterator<Item = Bound<'_, PyAny>>,
                      nodes: &[CNode]|
     -> PyResult<Option<u64>> {
        let mut total = 0;
        for (v, n) in values.zip(nodes) {
            match plain_nbytes(&v, n)? {
                Some(b) => total += b,
                None => return Ok(None),
            }
        }
        Ok(Some(total))
    };
    Ok(match node {
        CNode::Array {
            dtype,
            ndim,
            itemsize,
        } => {
            if !npy::is_exact_ndarray(obj)? {
                return Ok(None);
            }
            match npy::array_info(obj)? {
                Some(info) if info.descr == dtype.as_ptr() && info.dims.len() == *ndim => Some(
                    info.dims.iter().map(|&d| d as u64).product::<u64>() * u64::from(*itemsize),
                ),
                _ => None,
            }
        }
        CNode::Scalar { ty, itemsize } => obj
            .get_type()
            .is(ty.bind(py))
            .then_some(u64::from(*itemsize)),
        CNode::Bytes => obj
            .cast_exact::<PyBytes>()
            .ok()
            .map(|b| b.as_bytes().len() as u64),
        CNode::Str => match obj.cast_exact::<PyString>() {
            // SAFETY: `s` is a str; the GIL is held.
            Ok(s) => Some(unsafe { ffi::PyUnicode_GetLength(s.as_ptr()) }.max(0) as u64),
            Err(_) => None,
        },
        CNode::PyInt => obj.is_exact_instance_of::<PyInt>().then_some(8),
        CNode::PyFloat => obj.is_exact_instance_of::<PyFloat>().then_some(8),
        CNode::PyBool => obj.is_exact_instance_of::<PyBool>().then_some(8),
        CNode::None => obj.is_none().then_some(8),
        CNode::Tuple(items) => match obj.cast_exact::<PyTuple>() {
            Ok(t) if t.len() == items.len() => same_items(&mut t.iter(), items)?,
            _ => None,
        },
        CNode::NamedTuple(ty, items) => match obj.cast::<PyTuple>() {
            Ok(t) if obj.get_type().is(ty.bind(py)) && t.len() == items.len() => {
                same_items(&mut t.iter(), items)?
            }
            _ => None,
        },
        CNode::List(items) => match obj.cast_exact::<PyList>() {
            Ok(l) if l.len() == items.len() => same_items(&mut l.iter(), items)?,
            _ => None,
        },
        CNode::Dict(keys, nodes) => match obj.cast_exact::<PyDict>() {
            // Same length and every learnt key present: the same keys.
            Ok(d) if d.len() == nodes.len() => {
                let mut total = 0;
                let visit = |i: usize, v: &Bound<'_, PyAny>| -> PyResult<bool> {
                    Ok(match plain_nbytes(v, &nodes[i])? {
                        Some(b) => {
                            total += b;
                            true
                        }
                        None => false,
                    })
                };
                match keys.visit_in_order(d, visit)? {
                    Some(true) => Some(total),
                    Some(false) => None,
                    // Another order: one lookup per key.
                    None => match keys.looked_up(d)? {
                        Some(values) => same_items(&mut values.into_iter(), nodes)?,
                        None => None,
                    },
                }
            }
            _ => None,
        },
    })
}
