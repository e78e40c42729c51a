//! [`DictKeys`]: a compiled dict's keys, and reading an element's dict along them without a
//! hash lookup per key.

use super::*;

/// A compiled dict's keys. An element's dict built the same way as the learnt one (by the
/// same code, or as a copy of one dict) lists the same key objects in the same order, so
/// while the learnt dict listed them in the node's order its values are read in one pass
/// over its entries comparing key pointers, instead of one hash lookup per key.
pub(super) struct DictKeys {
    /// In the node's order (tf.nest's sorted order for an encoder's structure).
    pub(super) keys: Vec<Py<PyString>>,
    /// The learnt dict listed `keys` in this order.
    pub(super) in_order: bool,
}

impl DictKeys {
    /// The keys of `d` named `names` (tf.nest's sorted order), as `d`'s own key objects
    /// (the next elements' keys are likely the same objects), and `d`'s values in that
    /// order; None unless `d` holds exactly these str keys.
    pub(super) fn learn<'a, 'py>(
        d: &Bound<'py, PyDict>,
        names: impl ExactSizeIterator<Item = &'a str>,
    ) -> PyResult<Option<(DictKeys, Vec<Bound<'py, PyAny>>)>> {
        if d.len() != names.len() {
            return Ok(None);
        }
        // d's keys by name, with their places in d's order.
        let mut index: HashMap<String, (usize, Bound<'py, PyString>)> =
            HashMap::with_capacity(d.len());
        for (i, (k, _)) in d.iter().enumerate() {
            let Ok(k) = k.cast_into::<PyString>() else {
                return Ok(None);
            };
            let Ok(name) = k.to_str().map(str::to_owned) else {
                return Ok(None);
            };
            index.insert(name, (i, k));
        }
        let mut keys = Vec::with_capacity(d.len());
        let mut values = Vec::with_capacity(d.len());
        let mut in_order = true;
        for (j, name) in names.enumerate() {
            let Some((i, key)) = index.get(name) else {
                return Ok(None);
            };
            let Some(value) = d.get_item(key)? else {
                return Ok(None);
            };
            keys.push(key.clone().unbind());
            values.push(value);
            in_order &= *i == j;
        }
        Ok(Some((DictKeys { keys, in_order }, values)))
    }

    /// Calls `visit(i, value)` with `d`'s value of each key, in the order of `self.keys`,
    /// until one returns false, in one pass over `d`'s entries (no hash lookup) as long
    /// as they list the keys in that order. Returns None as soon as an entry does not (the
    /// values before it were visited: the caller undoes that and looks the keys up), else
    /// whether every visit returned true. The caller checked that `d` has as many
    /// entries as `self.keys`.
    pub(super) fn visit_in_order<'py>(
        &self,
        d: &Bound<'py, PyDict>,
        mut visit: impl FnMut(usize, &Bound<'py, PyAny>) -> PyResult<bool>,
    ) -> PyResult<Option<bool>> {
        if !self.in_order {
            return Ok(None);
        }
        let py = d.py();
        let mut pos: ffi::Py_ssize_t = 0;
        let mut k: *mut ffi::PyObject = std::ptr::null_mut();
        let mut v: *mut ffi::PyObject = std::ptr::null_mut();
        for (i, key) in self.keys.iter().enumerate() {
            // SAFETY: `d` is a live dict and the GIL is held; PyDict_Next only reads it
            // and stores borrowed references to its i-th entry in `k` and `v`.
            if unsafe { ffi::PyDict_Next(d.as_ptr(), &mut pos, &mut k, &mut v) } == 0 {
                return Ok(None);
            }
            // SAFETY: `k` and `v` are borrowed from `d`, which nothing has changed since
            // PyDict_Next; both are owned (increfed) here before any other call.
            let (k, v) = unsafe {
                (
                    Bound::from_borrowed_ptr(py, k),
                    Bound::from_borrowed_ptr(py, v),
                )
            };
            if !same_key(&k, key.bind(py)) {
                return Ok(None);
            }
            if !visit(i, &v)? {
                return Ok(Some(false));
            }
        }
        Ok(Some(true))
    }

    /// `d`'s value of each key, in the order of `self.keys`, by lookup (None: `d` lacks
    /// one).
    pub(super) fn looked_up<'py>(
        &self,
        d: &Bound<'py, PyDict>,
    ) -> PyResult<Option<Vec<Bound<'py, PyAny>>>> {
        let py = d.py();
        let mut values = Vec::with_capacity(self.keys.len());
        for key in &self.keys {
            match d.get_item(key.bind(py))? {
                Some(v) => values.push(v),
                None => return Ok(None),
            }
        }
        Ok(Some(values))
    }
}

/// Whether the dict key `k` is `key`: the same object, or an equal str.
fn same_key(k: &Bound<'_, PyAny>, key: &Bound<'_, PyString>) -> bool {
    if k.as_ptr() == key.as_ptr() {
        return true;
    }
    // SAFETY: both are live objects and the GIL is held; PyUnicode_Compare only reads them
    // (both are str once `k` passed the check; it returns -1 for "less" and on an error,
    // which is cleared here).
    unsafe {
        if ffi::PyUnicode_Check(k.as_ptr()) == 0 {
            return false;
        }
        let c = ffi::PyUnicode_Compare(k.as_ptr(), key.as_ptr());
        if c == -1 && !ffi::PyErr_Occurred().is_null() {
            ffi::PyErr_Clear();
            return false;
        }
        c == 0
    }
}
