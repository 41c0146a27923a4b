"""Word lists and number tables for the admission tagger (services/admission/tagger.py).

Data only. Each lexicon is matched case-insensitively, longest word first; English words need word
boundaries and may take a plural "s"/"es". Chinese words are matched anywhere, so a short Chinese word
that is part of a longer unrelated one goes in that lexicon's FALSE_FRIENDS: a hit inside a false
friend does not count ("程序" in "程序员" is a person, not code).

Domain words are the everyday ones people use ("landlord keeps the deposit", "市盈率", "statin"), not
only the professional ones; a word that belongs to two domains, or is common outside any, is left out.
"""

from __future__ import annotations

# --------------------------------------------------------------------------
# Task: the first task whose lexicon hits wins, in TASK_ORDER, so "translate this code" is a
# translation and "summarize this bug report" a summary.
# --------------------------------------------------------------------------

TRANSLATE_WORDS: tuple[str, ...] = (
    "翻译", "译成", "译为", "翻成", "英译中", "中译英", "译文",
    "英文怎么说", "英语怎么说", "中文怎么说", "日语怎么说", "日文怎么说", "韩语怎么说", "法语怎么说",
    "英文怎么表达", "英语怎么表达", "英文怎么写", "英语怎么写", "用英文说", "用英语说",
    "translate", "translated", "translation", "translating",
    "how do you say", "how do i say", "how to say", "the english for", "the english word for",
    "into english", "into chinese", "into french", "into spanish", "into german", "into japanese",
    "into korean", "into italian", "into russian", "into portuguese", "into arabic",
)
SUMMARIZE_WORDS: tuple[str, ...] = (
    "总结", "概括", "摘要", "归纳", "概述", "提炼", "要点", "中心思想", "大意", "缩写成", "压缩成",
    "summarize", "summarise", "summarizing", "summary", "summaries", "tl;dr", "tldr",
    "sum up", "recap", "condense", "key points", "main points", "gist", "boil down", "boil this down",
    "in a nutshell", "synopsis", "takeaways", "key takeaways",
)
CODE_WORDS: tuple[str, ...] = (
    "代码", "函数", "编程", "程序", "脚本", "报错", "调试", "正则", "算法", "编译", "数据库",
    "前端", "后端", "字符串", "数组", "变量", "递归", "线程", "并发", "单例", "防抖",
    "命令行", "源码",
    "python", "javascript", "typescript", "java", "c++", "c#", "golang", "sql", "rust program",
    "code", "coding", "function", "bug", "debug", "compile", "compiler", "regex", "regular expression",
    "stack trace", "traceback", "algorithm", "script", "```",
    "git", "github", "pandas", "numpy", "dataframe", "docker", "dockerfile", "kubernetes", "k8s",
    "node.js", "nodejs", "npm", "pip install", "react component", "react hook", "react app", "jsx",
    "vue", "django", "flask", "css", "html",
    "json", "yaml", "api", "http request", "bash", "shell script", "grep", "linux command",
    "nullpointerexception", "typeerror", "valueerror", "segfault", "segmentation fault", "out of bounds",
    "unit test", "refactor", "re-render", "rerender", "recursion", "repo",
)
CREATIVE_WORDS: tuple[str, ...] = (
    "诗", "故事", "小说", "歌词", "剧本", "童话", "散文", "作文", "创作", "绝句", "律诗", "对联", "春联",
    "祝福语", "贺词", "广告语", "宣传语", "文案", "笑话", "段子", "谜语", "绕口令", "顺口溜", "寓言",
    "poem", "poetry", "story", "stories", "lyrics", "haiku", "limerick", "sonnet", "verse", "rhyme",
    "rhyming", "novel", "fairy tale", "fiction", "screenplay", "song", "creative", "joke", "riddle",
    "wedding toast", "a toast", "slogan", "tagline", "fable",
)
TASK_LEXICONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("translate", TRANSLATE_WORDS),
    ("summarize", SUMMARIZE_WORDS),
    ("code", CODE_WORDS),
    ("creative", CREATIVE_WORDS),
)

# --------------------------------------------------------------------------
# Domain: the most hits wins; ties go to the earlier lexicon in DOMAIN_LEXICONS.
# --------------------------------------------------------------------------

MEDICAL_WORDS: tuple[str, ...] = (
    # conditions and symptoms
    "血糖", "血压", "血脂", "胆固醇", "尿酸", "痛风", "糖尿病", "高血压", "低血糖", "症状", "诊断", "疾病",
    "生病", "发烧", "发热", "咳嗽", "感冒", "流感", "头疼", "头痛", "头晕", "过敏", "鼻炎", "哮喘", "湿疹",
    "失眠", "拉肚子", "腹泻", "便秘", "呕吐", "牙疼", "牙痛", "扭伤", "骨折", "伤口", "发炎", "感染",
    "胃炎", "胃病", "幽门螺杆菌", "房颤", "心梗", "心脏病", "中风", "脑梗", "癌", "肿瘤", "抑郁症",
    "焦虑症", "贫血", "怀孕", "孕期", "月经", "嗓子疼", "喉咙痛", "疼痛", "老年痴呆", "阿尔茨海默",
    # care, tests, people, medicines
    "医生", "医院", "医嘱", "药", "治疗", "处方", "患者", "病人", "疫苗", "胰岛素", "血糖仪", "体检",
    "化验", "胸片", "核磁", "胃镜", "肠镜", "急诊", "挂号", "门诊", "住院", "手术", "康复", "护士",
    "药剂师", "中医", "针灸", "副作用", "他汀", "布洛芬", "对乙酰氨基酚", "阿司匹林", "抗生素", "冷敷",
    "热敷", "内科", "外科", "儿科",
    "diabetes", "blood sugar", "blood pressure", "symptom", "medication", "medicine", "doctor",
    "glucose", "glucose meter", "insulin", "diagnosis", "disease", "prescription", "hospital", "patient",
    "treatment", "dosage", "dose", "vaccine", "vaccination", "immune system",
    "cardiologist", "dermatologist", "pediatrician", "physician", "nurse", "pharmacist", "dentist",
    "surgeon", "clinic", "emergency room", "statin", "cholesterol", "ibuprofen", "acetaminophen",
    "paracetamol", "tylenol", "aspirin", "antibiotic", "painkiller", "side effect", "pill",
    "fever", "cough", "flu", "sore throat", "rash", "allergy", "allergies", "asthma", "eczema", "acne",
    "migraine", "headache", "stroke", "heart attack", "heart disease", "cancer", "tumor", "chemo",
    "chemotherapy", "surgery", "pregnant", "pregnancy", "mri", "x-ray", "ct scan", "blood test",
    "sprain", "sprained", "fracture", "broken bone", "injury", "dementia", "alzheimer's", "insomnia",
    "acid reflux", "heartburn", "nausea", "vomiting", "diarrhea", "infection", "arthritis", "sepsis",
    "physical therapy", "pain", "illness", "sick", "toothache",
)
LEGAL_WORDS: tuple[str, ...] = (
    "合同", "协议书", "保密协议", "租房协议", "离婚协议", "用户协议", "法律", "律师", "诉讼", "法院", "法官", "起诉", "违约", "条款", "判决", "判刑", "侵权",
    "法规", "仲裁", "违法", "合法", "非法", "犯法", "犯罪", "坐牢", "拘留", "刑法", "民法", "民法典",
    "劳动法", "保护法", "押金", "房东", "租客", "退租", "辞退", "开除", "解雇", "赔偿", "经济补偿", "工伤",
    "试用期", "离婚", "抚养权", "抚养费", "赡养", "遗嘱", "遗产", "继承权", "公证", "商标", "专利", "著作权",
    "版权", "抄袭", "维权", "盗用", "肖像权", "告他", "告她", "告对方", "醉驾", "酒驾", "交通事故", "全责",
    "借条", "欠条", "拖欠工资", "欠薪", "竞业",
    "contract", "lawsuit", "legal", "illegal", "attorney", "lawyer", "court", "sue", "litigation",
    "clause", "liability", "liable", "plaintiff", "defendant", "statute", "copyright", "arbitration",
    "landlord", "tenant", "lease", "security deposit", "evict", "eviction", "prenup", "prenuptial",
    "divorce", "custody", "alimony", "child support", "visitation", "a will", "my will", "last will",
    "living will", "living trust", "probate", "power of attorney", "notary", "notarized",
    "agreement", "nda", "non-disclosure", "non-compete", "the judge", "a judge", "jury", "verdict", "arrested",
    "police", "speeding ticket", "traffic ticket", "traffic court", "small claims", "trademark",
    "patent", "infringement", "copied my", "without permission", "fire me", "fired me", "get fired",
    "wrongful termination", "discrimination", "harassment", "indemnify", "lessee", "lessor",
    "gdpr", "terms of service", "rights",
)
FINANCE_WORDS: tuple[str, ...] = (
    "股票", "股市", "炒股", "投资", "贷款", "利率", "利息", "基金", "理财", "税", "债券", "可转债", "房贷",
    "车贷", "月供", "首付", "还款", "汇率", "存款", "分红", "市盈率", "市净率", "定投", "信用卡", "分期",
    "手续费", "余额宝", "花呗", "借呗", "征信", "逾期", "银行", "定期存款", "收益", "年化", "公积金",
    "比特币", "加密货币", "数字货币", "牛市", "熊市", "净值", "回撤", "保险", "保费", "养老金", "退休金",
    "加息", "降息", "通货膨胀", "通胀", "财报", "营收", "净利润", "利润", "存钱", "攒钱", "省钱", "记账",
    "预算", "复利", "本金", "估值", "市值", "期权", "期货", "外汇",
    "stock", "invest", "investment", "investing", "investor", "loan", "interest rate", "interest on",
    "compound interest", "tax", "taxed", "mortgage", "refinance", "portfolio", "dividend", "savings",
    "inflation", "recession", "etf", "401k", "401(k)", "ira", "roth", "index fund", "mutual fund",
    "fund", "bond", "bond yield", "shares", "share price", "buyback", "earnings", "revenue", "profit",
    "p/e", "pe ratio", "price-to-earnings", "sharpe ratio", "capital gains", "credit card",
    "credit score", "credit report", "apr", "paycheck", "salary", "budget", "bitcoin", "crypto",
    "cryptocurrency", "bank", "checking account", "savings account", "overdraft", "money",
    "stock market", "bear market", "bull market", "insurance", "pension", "retirement account",
)
DOMAIN_LEXICONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("medical", MEDICAL_WORDS),
    ("legal", LEGAL_WORDS),
    ("finance", FINANCE_WORDS),
)

# A hit inside one of these does not count for the label.
FALSE_FRIENDS: dict[str, tuple[str, ...]] = {
    "code": ("程序员",),  # a programmer is a person: a joke about one is not a coding job
    "expert": ("因为医生",),  # "because the doctor said" names no reader
}

# --------------------------------------------------------------------------
# Audience: the most hits wins; ties go to the earlier lexicon in AUDIENCE_LEXICONS.
# --------------------------------------------------------------------------

ELDERLY_WORDS: tuple[str, ...] = (
    "老人", "老年人", "长辈", "爷爷", "奶奶", "外公", "外婆", "姥姥", "姥爷", "老年", "退休", "老人家",
    "老大爷", "养老院", "敬老院", "老年大学",
    "elderly", "seniors", "senior citizen", "grandparent", "grandma", "grandpa", "grandmother",
    "grandfather", "older adult", "older people", "retiree", "nursing home",
)
CHILD_WORDS: tuple[str, ...] = (
    "孩子", "小朋友", "儿童", "小孩", "小学生", "幼儿", "宝宝", "幼儿园", "一年级", "二年级", "三年级",
    "四年级", "五年级", "六年级",
    "child", "children", "kid", "toddler", "preschooler", "kindergarten", "kindergartner",
    "first grader", "second grader", "third grader", "fourth grader", "fifth grader", "grade schooler",
    "elementary school",
)
# Bare "医生"/"doctor" means the medical domain; only "for doctors" names the reader. Professions in
# EXPERT_READERS name the reader only after a reader cue (tagger._EXPERT_READER).
EXPERT_WORDS: tuple[str, ...] = (
    "专家", "专业人士", "专业", "为医生", "给医生", "面向医生", "供医生", "从业者", "研究人员",
    "expert", "professional", "for doctors", "for physicians", "for clinicians", "technical audience",
    "specialist", "researchers",
)
AUDIENCE_LEXICONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("elderly", ELDERLY_WORDS),
    ("child", CHILD_WORDS),
    ("expert", EXPERT_WORDS),
)
# Professions: "for portfolio managers", "as a senior engineer", "我是一名药剂师", "面向心内科医生".
EXPERT_READERS_EN: tuple[str, ...] = (
    "doctor", "physician", "clinician", "nurse", "pharmacist", "surgeon", "radiologist", "cardiologist",
    "immunologist", "oncologist", "neurologist", "psychiatrist", "epidemiologist", "lawyer", "attorney",
    "paralegal", "judge", "accountant", "auditor", "analyst", "portfolio manager", "fund manager",
    "trader", "economist", "engineer", "developer", "programmer", "data scientist", "scientist",
    "researcher", "professor", "academic", "practitioner",
)
EXPERT_READERS_ZH: tuple[str, ...] = (
    "医生", "医师", "护士", "药剂师", "药师", "律师", "法官", "法务", "会计", "会计师", "审计师",
    "基金经理", "分析师", "工程师", "程序员", "开发者", "开发人员", "研究员", "科学家", "学者", "教授",
)

# --------------------------------------------------------------------------
# Language: function words that tell English prose from other Latin-script languages.
# --------------------------------------------------------------------------

ENGLISH_FUNCTION_WORDS: frozenset[str] = frozenset((
    "the", "a", "an", "is", "are", "was", "of", "to", "in", "and", "or", "for", "on", "with", "what",
    "how", "why", "when", "where", "who", "which", "do", "does", "can", "should", "my", "i", "you",
    "it", "this", "that", "please", "me", "be", "if", "not",
))
# Spanish, French, Portuguese, Italian and German; none of them is also a common English word.
FOREIGN_FUNCTION_WORDS: frozenset[str] = frozenset((
    "el", "la", "los", "las", "de", "del", "que", "y", "es", "está", "están", "un", "una", "por", "para",
    "con", "más", "dónde", "qué", "cómo", "cuál", "muy", "pero",
    "le", "les", "des", "du", "est", "et", "une", "avec", "dans", "qui", "je", "vous", "nous", "pas",
    "où", "très", "mais", "c'est", "il", "elle",
    "não", "você", "uma", "é", "onde", "muito", "em",
    "che", "della", "sono", "perché", "dove", "gli",
    "der", "das", "und", "ist", "nicht", "ich", "mit", "ein", "eine", "wie", "wo", "warum", "sehr",
))
# Chinese grammar: a segment holding one of these is a Chinese sentence whatever Latin words it names.
ZH_FUNCTION_CHARS = frozenset("的了吗呢吧么什怎这那请把被让给在是有和与或就都也还要会能用里个哪")
# Language names that follow "in"/"into" in a request to translate.
LANGUAGE_NAMES = "english|chinese|mandarin|french|spanish|german|japanese|korean|italian|russian|portuguese|arabic"

# --------------------------------------------------------------------------
# Numbers, units and chat roles.
# --------------------------------------------------------------------------

CN_DIGITS: dict[str, int] = {
    "零": 0, "〇": 0, "一": 1, "二": 2, "两": 2, "三": 3, "四": 4,
    "五": 5, "六": 6, "七": 7, "八": 8, "九": 9,
}
CN_SMALL_UNITS: dict[str, int] = {"十": 10, "百": 100, "千": 1000}
CN_BIG_UNITS: dict[str, int] = {"万": 10_000, "亿": 100_000_000}
CN_NUMERAL_CHARS = "".join(CN_DIGITS) + "".join(CN_SMALL_UNITS) + "".join(CN_BIG_UNITS)

EN_ONES: dict[str, int] = {
    "zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6,
    "seven": 7, "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12,
    "thirteen": 13, "fourteen": 14, "fifteen": 15, "sixteen": 16,
    "seventeen": 17, "eighteen": 18, "nineteen": 19,
}
EN_TENS: dict[str, int] = {
    "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60,
    "seventy": 70, "eighty": 80, "ninety": 90,
}
EN_SCALES: dict[str, int] = {"dozen": 12, "hundred": 100, "thousand": 1000}
# Articles stand for one in "in a sentence", "in a single word".
EN_ONE_ARTICLES = frozenset({"a", "an", "single", "a single"})

# Unit words of a length constraint -> BUDGET_RULES unit.
UNIT_ALIASES: dict[str, str] = {
    "字": "chars", "字符": "chars", "character": "chars", "char": "chars", "letter": "chars",
    "词": "words", "单词": "words", "word": "words",
    "句": "sentences", "句话": "sentences", "句子": "sentences", "sentence": "sentences",
    "token": "tokens",
}

# Role markers at the start of a line ("User:", "用户：", full-width colon too).
USER_ROLES: tuple[str, ...] = ("user", "human", "用户", "人类")
ASSISTANT_ROLES: tuple[str, ...] = ("assistant", "ai", "bot", "助手", "助理")
SYSTEM_ROLES: tuple[str, ...] = ("system", "系统")
