# Load the wheel's libnixl_capi.so WITHOUT importing the nixl Python package, as a Rust dlopen would.
import ctypes, glob, os, sys
libdir = glob.glob(os.path.join(sys.prefix, "lib/python3*/site-packages/.nixl_cu12.mesonpy.libs"))[0]
capi = ctypes.CDLL(os.path.join(libdir, "libnixl_capi.so"))
agent = ctypes.c_void_p()
rc = capi.nixl_capi_create_agent(b"capi-agent", ctypes.byref(agent)); print("create_agent rc", rc)
lst = ctypes.c_void_p()
rc = capi.nixl_capi_get_available_plugins(agent, ctypes.byref(lst)); print("get_plugins rc", rc)
n = ctypes.c_size_t(); capi.nixl_capi_string_list_size(lst, ctypes.byref(n))
names = []
for i in range(n.value):
    s = ctypes.c_char_p(); capi.nixl_capi_string_list_get(lst, ctypes.c_size_t(i), ctypes.byref(s)); names.append(s.value.decode())
print("plugins:", names)
params = ctypes.c_void_p(); capi.nixl_capi_create_params(ctypes.byref(params))
be = ctypes.c_void_p()
rc = capi.nixl_capi_create_backend(agent, b"UCX", params, ctypes.byref(be)); print("create_backend UCX rc", rc)
buf = (ctypes.c_uint8 * 8192)()
dl = ctypes.c_void_p(); capi.nixl_capi_create_reg_dlist(0, ctypes.byref(dl))
capi.nixl_capi_reg_dlist_add_desc(dl, ctypes.c_size_t(ctypes.addressof(buf)), ctypes.c_size_t(8192), ctypes.c_uint64(0), None, ctypes.c_size_t(0))
rc = capi.nixl_capi_register_mem(agent, dl, None); print("register_mem rc", rc)
data = ctypes.c_void_p(); ln = ctypes.c_size_t()
rc = capi.nixl_capi_get_local_md(agent, ctypes.byref(data), ctypes.byref(ln)); print("get_local_md rc", rc, "len", ln.value)
print("is_stub:", ctypes.CFUNCTYPE(ctypes.c_bool)(("nixl_capi_is_stub", capi))())
